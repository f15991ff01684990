"""The ``diffspec`` command line: the top layer, built on the shared library and the services."""
