"""In-process command-line programs of the library (`tandem generate`); `tandem/cli.py` only
dispatches to them, and (by exec) to the services, the launcher and `tandem_services.bench`."""
