"""The files the planner writes and reads back: plan files (:mod:`~treeattn.sim.files.export`,
validated by :mod:`~treeattn.sim.files.plan_file`) and calibration profiles' schema
(:mod:`~treeattn.sim.files.profile_schema`)."""
