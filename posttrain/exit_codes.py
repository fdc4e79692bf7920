"""Process exit codes of every posttrain command (documented in the README and in ``posttrain --help``)."""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2  # bad config or bad input: the message names file, line and field
EXIT_RESUMABLE = 75  # preempted (SIGTERM/SIGINT): a checkpoint was saved; rerun the same command to resume
