"""A discrete-event simulator of asyncrl at cluster scale.

`model` runs the event loop (actors, hub, learner, weight publications) around the real
`replay` admission and buffer code (`hub`); `timing` holds the time models; `calibrate` fits
them to measured runs; `cluster` derives them from stated hardware assumptions.
"""
