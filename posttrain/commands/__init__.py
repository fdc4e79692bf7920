"""Tool subcommands of the ``posttrain`` CLI that are not recipes."""
