"""hogshard.ps: the shard server, built from parts with small interfaces.

============================  ==================================================================
file                          classes
============================  ==================================================================
server.py                     ShardServer: owns the sockets and the loop, wires the parts
server_requests.py            ServerRequests: binds the op table, checks every request
op_table.py                   server_ops: every op's header and roles, bound to its handler
dense_ops.py                  DenseOps: init, push, pull, leave, stats
dense_pulls.py                DensePulls: dense pulls, and those the policy holds back
embedding_ops.py              EmbeddingOps: the emb_* ops
replica_ops.py                BackupOps: replicate, replica_snapshot, emb_replicate, emb_snapshot
dense.py                      DenseStore, DenseTable, DenseChunk
embedding.py                  EmbeddingTable: sparse rows created on first touch, row-wise state
embedding_store.py            EmbeddingStore: all embedding tables; requests checked whole
row_block.py                  RowBlock, TableKeys: rows and state shared by same-shaped tables
disk_table.py                 DiskTable, DiskTier: a table direct-mapped in files (--embedding-disk)
row_bitmap.py                 RowBitmap: which rows of a disk table exist, one bit per id
embedding_checkpoint.py       save_tables, load_tables: the embedding file of a checkpoint
npz_stream.py                 write_member, read_member: .npz arrays a block of rows at a time
embedding_fused.py            fused_pull, fused_push: one pass over a request's tables of a block
row_checks.py                 check_ids, check_grads: a row request checked before rows change
row_bounds.py                 CountMinSketch: row admission that bounds a table's memory
row_gate.py                   RowGate, HeldPull: the pull gate of ssp:S embedding tables
rules.py                      UpdateRule: a torch.optim optimizer stepped over chunks (make_rule)
row_rules.py                  RowRule: RowSGD, RowWiseAdagrad, RowAdam (make_row_rule)
table_rules.py                TableRules: a table's rule per parameter group, live hyperparameters
staging.py                    StagedPushes: partial pushes held until their step's closing push
applier.py                    UpdateApplier: staleness, groups and modifiers of the policy
executor.py                   UpdateExecutor: InlineUpdates, ThreadedUpdates
update_pool.py                UpdatePool, UpdateJob, Ticket: the update threads
workers.py                    WorkerView (live workers, clocks, pull gate), PolicySchedule
decoding.py                   PayloadDecoder: compressed pushes to dense gradients (sparse: checked by values)
replication.py                Replicator: roles, links to backups, leases, recent push ids
primary.py                    Primary: replicated pushes, held replies
group_replies.py              GroupReplies, HeldReply: replies waiting for their groups, backups
peer_gate.py                  PeerGate: who may send the server-to-server ops
embedding_replica.py          shard_rows, snapshot_messages: embedding shards between servers
embedding_slots.py            SlotRoles: embedding slots served, handed off, dropped
slot_pushes.py                SlotPushes: which slots of each recent push a server holds
chunk_moves.py                ChunkMoves: dense chunks handed to another server by a drain
scheduler_link.py             SchedulerLink, Registration: registration and heartbeats
shard_report.py               register_fields, heartbeat_fields, table_report: the reports
checkpoint.py                 ShardCheckpointer, save_shard, restore_shard
export.py                     export_checkpoint: a checkpoint rewritten in the serving format
export_rows.py                CheckpointRows, merged, changed: an export's rows, streamed
shm_plane.py                  ShmPlane: the server's side of the shared-memory fast path
doorbells.py                  Doorbells: co-located workers' request pipes, beside the ROUTER
stats.py, metrics.py          ServerStats; ServerCollector (Prometheus)
============================  ==================================================================
"""
