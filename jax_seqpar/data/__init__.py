"""Packed training data: packing documents into fixed ``[B, S]`` rows (NumPy).

``pack_documents(documents, seq_len, ...)``: token arrays -> fixed ``[B, S]`` batches of
``tokens``, ``segment_ids``, ``positions``, ``loss_mask`` and a ``PackingReport``.
"""

from jax_seqpar.data.packing import (KEYS, LONG_DOCUMENTS, POLICIES, SPLIT_POSITIONS,
                                     PackOptions, Packed, pack_documents, pack_rows)
from jax_seqpar.data.report import PackingReport

__all__ = ["KEYS", "LONG_DOCUMENTS", "POLICIES", "SPLIT_POSITIONS", "PackOptions", "Packed",
           "PackingReport", "pack_documents", "pack_rows"]
