"""Transport: sockets (sockets.py), the client connection to the hub and its delivery ledger
(connection.py), CURVE authentication (auth.py)."""
