"""The model process of one TP rank: the loop and its components (see loop.py)."""
