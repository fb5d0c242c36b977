"""The machinery behind :class:`~embcache.EmbeddingCache`, one room per concern.

- :mod:`.table`: ``TableEngine``, one table's state (lock, tiers, clock, sketch, recent rows)
  and its operations: the lookup path, staging, ``modify``, ``arrange``, pins, resize;
- :mod:`.update`: gradients applied where each row lives; ``assign``;
- :mod:`.admission`: admission of new keys (``TableConfig.admit_after``);
- :mod:`.expiry`: expiry of rows (``TableConfig.ttl_steps``, ``ttl_seconds``): touches, the sweeper, deletion;
- :mod:`.placement`: moves between tiers planned as a :class:`~.placement.Plan`, carried out by
  one :func:`~.placement.commit`;
- :mod:`.rows`: rows to and from the store: the record format, counted reads and writes, the
  write log, the metadata names;
- :mod:`.passes`: prefetch jobs, leases, ``begin_pass``/``end_pass``;
- :mod:`.durability`: the path lock, write-back, flush, checkpoints, restore;
- :mod:`.catalog`: table definitions and each table's share of memory;
- :mod:`.stats`: counters and the ``stats()`` report; :mod:`.lock`: the GPU-ordered table lock.
"""
