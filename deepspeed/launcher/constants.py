"""Names and defaults shared by the launcher modules; spelled as upstream DeepSpeed spells them."""

from __future__ import annotations

PDSH_LAUNCHER = "pdsh"
PDSH_MAX_FAN_OUT = 1024

OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
MVAPICH_LAUNCHER = "mvapich"
SLURM_LAUNCHER = "slurm"

MULTI_NODE_LAUNCHERS = (
    PDSH_LAUNCHER,
    OPENMPI_LAUNCHER,
    MPICH_LAUNCHER,
    IMPI_LAUNCHER,
    MVAPICH_LAUNCHER,
    SLURM_LAUNCHER,
)

MVAPICH_TMP_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"

ELASTIC_TRAINING_ID_DEFAULT = "123456789"

# Same value as deepspeed.comm.utils.TORCH_DISTRIBUTED_DEFAULT_PORT; repeated here so that the launcher does not
# import the comm package (and torch with it) to read a number.
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

# `--save_pid` writes `<PID_FILE_BASEPATH>/<runner pid>.deepspeed` holding the per-node launcher's pid.
PID_FILE_BASEPATH = "/tmp"

# Seconds a child gets between SIGTERM and SIGKILL when the launcher tears a job down.
TERMINATE_GRACE_SECONDS = 5.0

# How often the supervisors look at their children.
POLL_INTERVAL_SECONDS = 0.05
