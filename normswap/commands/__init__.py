"""The core subcommands: convert, inspect, verify."""
