"""Keysets: the unique keys of a pass (per table) with their access counts.

A pass's keyset is what :meth:`EmbeddingCache.prefetch` stages and :meth:`EmbeddingCache.begin_pass`
pins. Counts order the keys when not all of them fit in memory: the most frequent go first.

Besides :class:`Keyset` itself this package computes keysets from training data and stores them:

* :func:`keysets_from_batches` counts the keys of an iterable of batches (``{table: keys}``).
* :func:`keysets_from_file` counts the keys of a data-set file: a ``.npy`` array of integer ids
  ``[samples, columns]`` (one column per categorical feature; memory-mapped, read in chunks),
  or several such files taken as one sequence of samples. ``tables[j]`` names the table of
  column ``j``; columns that share a table are counted together.
* :func:`split_passes` cuts such a data set into passes, by sample count and/or by a budget on
  each pass's keyset (rows per table, or bytes given each table's row size), so that every pass
  fits in HBM+DDR; each pass comes with its keysets.
* :func:`save_keysets` / :func:`load_keysets` write and read one pass's keysets as a ``.npz``
  file (keys and counts per table, a format name and version, optional JSON metadata); loading
  validates everything and raises :class:`KeysetFileError` on a damaged or mismatched file.

Counting is vectorized: each chunk of keys is reduced with ``torch.unique`` and partial counts
are merged the same way, never per key in Python. Long extractions show a tqdm progress bar.

The package: :mod:`.keyset` holds :class:`Keyset` (and what the others share),
:mod:`.counting` the counting from batches and data-set files and :func:`split_passes`, and
:mod:`.files` the keyset file format.
"""

from .counting import KeysetBudgetWarning, PassSpan, keysets_from_batches, keysets_from_file, split_passes
from .files import KEYSET_FORMAT, KEYSET_VERSION, keyset_file_meta, load_keysets, save_keysets
from .keyset import Keyset, KeysetFileError, as_keysets

__all__ = [
    "KEYSET_FORMAT",
    "KEYSET_VERSION",
    "Keyset",
    "KeysetBudgetWarning",
    "KeysetFileError",
    "PassSpan",
    "as_keysets",
    "keyset_file_meta",
    "keysets_from_batches",
    "keysets_from_file",
    "load_keysets",
    "save_keysets",
    "split_passes",
]
