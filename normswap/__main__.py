from normswap.cli import entry

entry()
