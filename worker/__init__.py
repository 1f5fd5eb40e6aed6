"""hogshard.worker: a training process's side of the job, built from parts with small interfaces.

============================  ==================================================================
file                          classes
============================  ==================================================================
client.py                     PSClient: tables, push and pull, membership, the public API
channel.py                    Channel: sockets, requests in flight, request, pump
dense.py                      push, pull: dense tables' requests and the landing of replies
sparse.py                     EmbeddingHandle; create_table, pull_rows, push_rows (rows by id)
tables.py                     DenseHandle: chunks, owners, pulled versions (open_dense_table)
control.py                    call_across_restarts, reregister, leave: scheduler restarts
heartbeat.py                  Heartbeat: the thread sending clock and progress
stop_signal.py                install: SIGTERM as a graceful leave, exit status 143
futures.py                    Future, PendingRequest, RequestBook: requests in flight
replies.py                    pump: replies read, requests settled or sent elsewhere
rerouting.py                  Rerouter, Route: requests follow chunks that moved
shm.py                        ShmLink: the shared-memory fast path with servers on this host
doorbell.py                   Doorbells: pipes to the co-located servers, for small requests
traffic.py                    Traffic: frame bytes sent and received by op
shard.py                      Shard, ShardSampler: this rank's share of a data set, by epoch
optimizer.py                  PSOptimizer: a torch.optim.Optimizer whose updates servers apply
param_groups.py               GroupHyper: param_groups as a table's rule and a push's hyper
overlap.py                    GradientBuckets: pushes while backward still runs
device.py, cuda.py            HostMirror, CudaMirror: weights on the model's device
embedding.py                  RemoteEmbeddingBag: a torch embedding bag on the servers
row_fetch.py                  FetchedRows, pull_fetched: a bag's rows for one batch, pulled, landed
row_push.py                   RowPushes: row gradients pushed as backward ends, waited for
row_optim.py                  row_rule_of: the row rule a torch.optim optimizer means
row_args.py                   torch_sizes, padding_index: nn.EmbeddingBag's arguments checked
row_state.py                  save_rows, load_rows: a remote table's rows in state_dict()
remote_modules.py             RemoteEmbedding, remote_embeddings: a model's tables made remote
row_cache.py                  RowCache: hot embedding rows with bounded staleness
compression.py                Compressor, ErrorFeedback, DGC: compressed pushes
compression_policy.py         CompressionPolicy, TableRule: which codec each table uses
auto_codec.py                 ``auto``: a table's codec from the measured link and codec cost
recipes.py                    Recipe: the server rule and lr each codec trains with
export.py                     ExportedModel, ServingEmbeddingBag: serving from an export
layout.py                     param_layout, match_layout: where each parameter lies in a table
============================  ==================================================================
"""
