"""Torch modules whose embedding tables live in an embedding cache (embedded or remote).

``CachedEmbedding``, ``CachedEmbeddingBag`` and ``CachedEmbeddingBagCollection`` behave like
``torch.nn.Embedding`` / ``torch.nn.EmbeddingBag`` / torchrec's ``EmbeddingBagCollection``, but
hold no copy of the table: every forward looks up the batch's unique keys in the cache, and
every backward hands their gradients to the cache, which applies the table's own optimizer
(the one in its :class:`~embcache.TableConfig`) in place.

Fused backward-optimizer. This is the design of FBGEMM's table-batched embeddings (TBE): the
optimizer step of the embedding rows happens *inside* ``loss.backward()``. Consequences:

* There is no ``optimizer.step()`` for the embeddings and ``zero_grad()`` does not concern them;
  the modules have no parameters (``list(m.parameters()) == []``). A torch optimizer still steps
  the dense part of the model. Their ``state_dict()`` entry holds the rows (see "Checkpoints").
* Each backward is one step. Gradient accumulation over micro-batches (several backwards before
  one ``step``) steps each time; so does a second backward through a retained graph.
* A table used by two modules (or one module called twice) in one step gets one optimizer step
  per backward node, each with its own gradient. For SGD that equals torch's single step with
  the summed gradient (up to rounding); for stateful optimizers (AdaGrad, Adam) it does not.
  :class:`CachedEmbeddingBagCollection` merges the features of a table into one lookup and one
  update, which is exactly torch's summed gradient.
* Every key a bag refers to is updated, with a zero gradient where the pooling gives it none
  (max mode, zero per-sample weights), as torch's sparse gradient lists every looked-up index;
  for SGD and AdaGrad a zero gradient changes nothing, Adam's moments decay. Keys equal to
  ``padding_idx``, and keys after the last offset with ``include_last_offset=True``, are not
  looked up at all.

Updates happen only when the module is in training mode and gradients are enabled. Under
``torch.no_grad()``/``torch.inference_mode()`` or after ``module.eval()`` the lookups still
happen (and count in the cache's statistics), the outputs do not require grad, and nothing is
applied.

Devices. Rows come back on ``cache.device``; keys are uniqued and bags pooled there. Outputs
are on the device where the model computes: the module's ``device`` argument when given, else
``cache.device`` (TorchRec's rule: a collection returns on the module's device, wherever its
input was). Inputs may be on the host or on that device: a data loader's host tensors need no
copy. A remote ``embcache.Client`` returns rows on the CPU, so a module over one that feeds a
CUDA model takes ``device="cuda"``. Gradients flow back across the copy to the cache.

Copies. ``copy.deepcopy`` of a module (or of a model holding one) shares the cache, so the copy
reads and trains the same table; ``module.to(device)`` changes nothing (there is nothing to move).
The modules cannot be pickled with the cache; save their ``state_dict()`` (see "Checkpoints").

Checkpoints. Each module's ``state_dict()`` has one entry, ``<prefix>._extra_state`` (torch's key
for non-tensor state), for its tables (a collection: all of its tables), so a training script
that does ``torch.save(model.state_dict())`` and later ``model.load_state_dict(torch.load(...))``
(``weights_only`` loading works) resumes with the same rows. The ``persist`` argument says what
the entry holds:

* ``"rows"`` (default): the stored rows themselves, whole (keys, weights with the optimizer state,
  access frequencies), exported from the cache (dirty rows are written back first). For tables
  up to ``max_state_bytes`` (default 256 MiB of records, all of the module's tables together);
  above it the entry holds no rows and ``state_dict()`` warns (``RuntimeWarning``).
* ``"checkpoint"`` with ``checkpoint_dir``: ``state_dict()`` writes a consistent cache checkpoint
  (``cache.checkpoint``, all tables) to a new ``checkpoint_dir/embcache-<time>-<id>`` and the
  entry names it by its absolute path; modules sharing a cache share one checkpoint per
  ``state_dict()`` call. Old checkpoints are not deleted. For tables of any size.
* ``"none"``: no entry (the cache persists itself with ``flush``/``checkpoint``/``restore``).

``load_state_dict`` makes the module's tables in its cache hold exactly the saved rows: it
imports them (``import_rows``) and deletes stored rows the saved cache did not have (a later
lookup creates them from the initializer, as the saved cache would). The tables must have the
saved layout (dim, optimizer, dtype, initializer, seed), else it fails; an entry missing from the
state_dict is a missing key (strict loading fails, ``strict=False`` reports it). A remote
``embcache.Client`` can neither export nor import rows: ``persist="rows"`` warns on save and load
that the rows are not in the state_dict, ``persist="checkpoint"`` makes the servers checkpoint
(``Client.checkpoint``; the entry lists their directories) and warns that resuming means
restarting the servers from those directories; ``persist="none"`` silences this.

TorchRec. :class:`CachedEmbeddingBagCollection` stands in for torchrec's ``EmbeddingBagCollection``
(torchrec is optional; nothing here imports it unless a KeyedJaggedTensor comes in):

* Input: a ``KeyedJaggedTensor``, duck-typed (``keys()``, ``values()``, ``lengths()`` or
  ``offsets()``, optionally ``weights_or_none()`` as per-sample weights and ``stride_per_key()``
  for variable batch sizes per feature), or the mapping ``{feature: input}`` as before. Features
  of the KJT that the collection does not have are ignored (torchrec's rule).
* Output follows the input: a mapping gives ``{feature: tensor}`` (as always); a KJT gives a
  torchrec ``KeyedTensor`` (keys in the collection's feature order) when torchrec is installed,
  else that same dict.
* Configuration: :meth:`CachedEmbeddingBagCollection.from_torchrec` takes torchrec's
  ``EmbeddingBagConfig``s (``name`` is the cache table, ``embedding_dim`` must be its dim,
  ``feature_names`` and per-table ``pooling`` SUM or MEAN are kept, ``num_embeddings`` is ignored:
  keys are any int64) and :meth:`~CachedEmbeddingBagCollection.embedding_bag_configs` gives them
  back, which torchrec's DLRM reads; :func:`tables_from_torchrec` makes the cache's TableConfigs.

torch.compile. The modules' ``forward`` is wrapped in ``torch.compiler.disable`` (when the first
module is built: that imports ``torch._dynamo``, which ``import embcache`` avoids): Dynamo does not
trace into it (it would reach the store's numpy code and the data-dependent ``torch.unique``)
and makes a graph break there instead, so a model holding the modules compiles with any backend
(inductor by default) and its dense layers are compiled, while the cache calls run eagerly.
Their autograd node is an ordinary one in the middle of the compiled graphs, so
``loss.backward()`` still hands the gradients to the cache. Training is the same as in eager
mode (tests/test_nn_compile.py). The lookup is not a ``torch.library`` custom op on purpose: its
output size depends on the batch's unique keys and its backward has a side effect (the optimizer
step in the cache) that an op returning nothing would have to keep from being pruned; the graph
break costs one Python call per module and forward, next to a cache round trip.

Errors (raised before anything is looked up, so a bad batch changes nothing):

* ``TypeError``: input, offsets or per_sample_weights is not a tensor (or None where allowed).
* :class:`~embcache.errors.InvalidKeysError` (a ``ValueError``): bad dtype or shape of input,
  offsets or per_sample_weights; offsets not starting at 0, decreasing or past the input's
  length; offsets given with a 2-D input or missing with a 1-D one; a collection batch whose
  features are not the configured ones. torch raises ``ValueError`` for the shape errors its
  Python layer checks and ``RuntimeError`` for the rest; here it is one type throughout.
* ``NotImplementedError``: per_sample_weights with mode "mean" or "max", with torch's own message,
  so code written for ``torch.nn.EmbeddingBag`` catches the same type.
* At construction: :class:`~embcache.errors.UnknownTableError` (a ``KeyError``) for a table
  the cache does not have, :class:`~embcache.errors.ConfigError` (a ``ValueError``) for a bad
  mode, padding_idx or feature mapping, ``TypeError`` for an object that is not a cache.
* Errors of the cache itself (e.g. ``NonFiniteGradientError`` from a NaN loss) surface from
  ``forward`` or ``loss.backward()`` unchanged; the cache applies nothing then.

Differences from torch, on purpose: keys are any int64 (there is no ``num_embeddings`` and no
index-out-of-range error); ``padding_idx`` is a key value (a negative one is a key, not an
index counted from the end); a 2-D input with zero columns gives empty bags (zeros) where torch
fails; per_sample_weights of any floating dtype are cast to float32 (torch wants the weight's
dtype); with ``include_last_offset=True``, keys after the last offset belong to no bag in every
mode (torch's "sum" ignores them, but its "mean" counts them and its "max" pools them into the
last bag); ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are not offered.

The package: :mod:`.modules` holds the three modules, :mod:`.bags` the checking, uniquing and
pooling of their batches, :mod:`.lookup` :class:`CacheLike` and the autograd node that looks
rows up and hands their gradients to the cache, :mod:`.state` their state_dict entry, and
:mod:`.torchrec_interop` the TorchRec types.
"""

from .bags import MODES, FeatureInput
from .lookup import CacheLike
from .modules import CachedEmbedding, CachedEmbeddingBag, CachedEmbeddingBagCollection
from .state import DEFAULT_MAX_STATE_BYTES, PERSIST, STATE_KEY
from .torchrec_interop import EmbeddingBagConfigLike, tables_from_torchrec

__all__ = [
    "DEFAULT_MAX_STATE_BYTES",
    "MODES",
    "PERSIST",
    "STATE_KEY",
    "CacheLike",
    "CachedEmbedding",
    "CachedEmbeddingBag",
    "CachedEmbeddingBagCollection",
    "EmbeddingBagConfigLike",
    "FeatureInput",
    "tables_from_torchrec",
]
