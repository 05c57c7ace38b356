"""Training across devices, applied from outside the plain model (docs/parallel.md).

genolong/model never sees a process group. This package holds what a multi-process run adds:
the parallel layout (`layout`), and the passes that wrap a built model for it.
"""
