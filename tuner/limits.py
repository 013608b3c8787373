"""How long the tuner waits for each thing, in seconds: one place for every timeout and interval."""

# A compile running this long is stuck (they take 10-60 s, nvcc included): its pool is killed, it
# is recorded as a hang and the others are compiled again.
COMPILE_S = 240.0
# The gate's child (load, check against the oracle, time) is killed and judged a hang after this.
GATE_S = 300.0
# The same for FLA's op (tuner.baseline): FLA autotunes its kernels on the first call at each shape,
# minutes for chunk_gla and chunk_kda.
BASELINE_S = 1800.0
# A worker beats for its RUNNING trials this often; a trial whose beat is GRACE_S old is taken
# for lost by the other workers of the study, failed and re-proposed.
HEARTBEAT_S = 30.0
GRACE_S = 120.0
# A RUNNING trial with no worker tag this long after its start was orphaned inside study.ask():
# a live worker tags its trial within milliseconds of asking for it.
ORPHAN_S = 10.0
# How often a trial waiting for another worker's judgement of the same kernel looks for it.
WAIT_POLL_S = 2.0
# How soon a Ctrl-C is acted on.
STOP_POLL_S = 1.0
# How long a write waits for a SQLite database another process holds locked.
DATABASE_BUSY_S = 60.0
