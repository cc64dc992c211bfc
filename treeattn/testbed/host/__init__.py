"""What a rank's host CPU adds to a step, as a CPU test bed shows it.

A GPU cluster's prediction does not need this package's effects; a run of CPU ranks on one
host does. :mod:`treeattn.testbed.host.profiles` turns a calibration into the models,
:mod:`treeattn.testbed.host.cold` prices host steps that run cold after the attention kernel,
and :mod:`treeattn.testbed.host.partial_reduction` decides which ranks run as the runtime's
compiled reduction.
"""
