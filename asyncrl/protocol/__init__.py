"""The wire protocol: messages (messages.py), their codec (codec.py) and its hot paths
(group_codec.py, compiled from _hotpath.c where a C compiler was found)."""
