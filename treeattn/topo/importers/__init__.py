"""Topologies read from tools' outputs: nvidia-smi, rocm-smi, NCCL/RCCL XML and JSON.

:mod:`treeattn.topo.importers.detect` picks the format and is what callers use; the other
modules each read one format (:mod:`~treeattn.topo.importers.common` holds their helpers).
"""
