"""The states an action can end an invocation in, worst first (a matrix cell takes the worst of its actions)."""

FAILED = "failed"
SKIPPED = "skipped"  # an input failed
STOPPED = "stopped"  # running when the build stopped
NOT_STARTED = "not_started"
TO_BUILD = "to_build"  # a plan: would execute
EXECUTED = "executed"
CUTOFF = "cutoff"  # early cutoff: its inputs re-ran to identical outputs
CACHED_SHARED = "cached_shared"
CACHED_LOCAL = "cached_local"
CACHED = "cached"  # a plan: cached in some tier
NOT_NEEDED = "not_needed"  # only cached consumers need it
STATES = (FAILED, SKIPPED, STOPPED, NOT_STARTED, TO_BUILD, EXECUTED, CUTOFF, CACHED_SHARED, CACHED_LOCAL, CACHED,
          NOT_NEEDED)
