"""The `graftlab` command and its subcommands."""
