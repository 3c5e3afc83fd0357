"""Analysis of testbed results: load job directories, compare synchronizers (``python -m analysis``)."""
