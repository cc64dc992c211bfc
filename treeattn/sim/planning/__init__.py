"""Choosing a plan: the candidates scored (``candidates``), the search (``planner``), its
answer in words (``explain``), and the size bound past which planning is refused
(``plan_size``)."""
