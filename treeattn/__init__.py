"""treeattn: topology-aware Tree Attention decoding.

Model the cluster (``treeattn.topo``), predict each reduction plan (``treeattn.sim``), run the
chosen plan for real (``treeattn.runtime``) with local attention kernels (``treeattn.kernels``),
decode with a real model on a sharded KV cache (``treeattn.llm``), and check the measurement
against the prediction.
"""

__version__ = "0.1.0"
