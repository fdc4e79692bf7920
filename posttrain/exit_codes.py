"""Exit codes of every ``posttrain`` command, in one place (documented in ``posttrain --help``).

A scheduler or a shell loop keys on these: ``EXIT_RESUMABLE`` means "a checkpoint was saved because the
job was preempted; run the same command again to resume", which is not a failure.
"""

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_CONFIG = 2  # bad config or input: fix the file/flag named in the message
EXIT_RESUMABLE = 75  # preempted (SIGTERM/SIGINT) after saving a checkpoint (75 is EX_TEMPFAIL in sysexits.h)
