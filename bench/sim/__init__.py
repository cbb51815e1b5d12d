"""A discrete-event simulator of asyncrl at cluster scale.

`model` runs the event loop (actors, learner, weight publications) around the hub's own core
(`replay.core.HubCore`: admission, credits, buffer, batches); `timing` holds the time models;
`calibrate` fits them to measured runs; `cluster` derives them from stated hardware assumptions.
"""
