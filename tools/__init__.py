"""Operator tools over asyncrl runs (launch on a cluster); only the `asyncrl` CLI imports them."""
