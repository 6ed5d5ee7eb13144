"""What runs around the attention: several processes (``distributed``: ``initialize``,
host <-> global arrays; ``launch``: N local processes of one job), what the compiled
program communicates (``comm``: bytes per collective; ``overlap``: what runs while each
collective is in flight), and the JAX version shims (``_compat``).

Nothing here imports the rest of the package, so every layer above may use it.
"""
