"""Client hints on the server: hints that travel with the request and the standalone hint listener."""
