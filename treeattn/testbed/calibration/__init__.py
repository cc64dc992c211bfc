"""The CPU calibration: the microbenchmarks that write a profile (:mod:`.calibrate`), the
executor's own per-step cost (:mod:`.overhead`) and the host steps that run cold after the
attention kernel (:mod:`.cold`)."""
