"""In-process command-line programs of the library (`tandem generate`); `tandem/cli.py` only
dispatches to them, to `tandem.bench`, and (by exec) to the services and the launcher."""
