"""hogshard.proto: what every role shares (imports nothing else of hogshard).

====================  ============================================================================
``wire.py``           :class:`Message`, :class:`Limits`, ``encode``/``decode``: frames and headers
``transport.py``      ``bind_router``, ``connect_dealer``, ``send``, ``recv_message``, ``RpcChannel``
``service.py``        :class:`ServiceCore`, :class:`Replies`: the request loop of every service
``requests.py``       :class:`Request`, :class:`Reply`, ``HELD``: the one handler contract
``held.py``           :class:`HeldRequests`: requests answered later, bounded per peer and in all
``clock_gate.py``     :class:`ClockGate`: workers' clocks and a policy's gate on pulls (joiners too)
``ops.py``            :class:`OpSpec`, ``declare_ops``, ``bind_ops``, ``check_header``: op tables
``dispatch.py``       ``as_error``: a handler's failure, typed
``roles.py``          :class:`Role`, ``roles_of``: who a connection is
``security.py``       :class:`Security`, ``generate_keys``, ``load_security``: CURVE and ZAP
``handshakes.py``     :class:`HandshakeMonitor`, :class:`DenialLog`: refused handshakes, logged
``connect_watch.py``  :class:`ConnectWatch`: what a connecting socket saw (nothing listening,
                      a handshake refused for keys), for "no reply" messages
``errors.py``         :class:`ErrorCode`, :class:`HogshardError` and its typed subclasses
``config.py``         :class:`ClientSettings`, ``env_name``: configuration, read in one place
``malloc.py``         ``tune_malloc``: glibc settings that keep large receive buffers
``manifest.py``       ``write_manifest``, ``load_manifest``, ``atomic_write``: checkpoint files
``metrics.py``        :class:`MetricsServer`, ``snapshot``, ``staleness_histogram``
``peerlog.py``        :class:`PeerErrorLog`: error replies logged once per peer
``policy.py``         :class:`ConsistencyPolicy`, ``parse_policy``: Rudra / SSP policies (pure)
``rule_groups.py``    ``check_table_rule``, ``check_hyper``: parameter groups, live values
``rule_specs.py``     ``check_rule_spec``, ``check_params``: rules' parameters, defaults, ranges
``tables.py``         :class:`Chunk`, :class:`DenseTableSpec`, :class:`EmbeddingSpec`: table specs
``packed_rows.py``    ``pack``, ``split_ids``, ``split_rows``: many tables' rows in one frame
``hashing.py``        ``splitmix64``, ``shard_of``, ``init_rows``: ids to shards and rows
``slot_index.py``     :class:`SlotIndex`: a vectorised id -> slot map (embedding rows, row cache)
``shm.py``            :class:`Segment`, :class:`PeerSegments`: shared memory on one host
``doorbell.py``       :class:`BellEnd`, ``pack``: the pipe messages of a co-located doorbell
``export_format.py``  ``check_export_manifest``, ``embedding_file``: the export-for-serving format
``param_layout.py``   ``check_param_layout``: where each parameter lies in a dense table
``codecs/``           :class:`Codec` (``base.py``) and its codecs (``simple.py``, ``sparse.py``,
                      ``lowrank.py``; half precision in ``half.py``), ``make_codec``
                      (``registry.py``), pull codecs (``pull.py``)
====================  ============================================================================
"""
