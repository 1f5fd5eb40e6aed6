"""hogshard.scheduler: the control plane of a job, built from parts that each own their state.

============================  ================================================================
``service.py``                :class:`Scheduler`: binds the socket (the shared loop of
                              ``proto/service.py``), wires the parts and answers the ops
``op_table.py``               ``scheduler_ops``: every op, its typed header and who may send it
``membership.py``             :class:`MembershipTable`, :class:`Member`: ranks, liveness,
                              fencing, worker clocks; :class:`Roster`, what other parts need
``shard_map.py``              :class:`ShardMap`: declared tables, primaries and backups, the
                              map epoch, the map relearnt from servers after a restart
``placement.py``              :class:`PlacedTable`, ``plan_dense_table``: the chunk planner
                              (pure; :class:`Chunk`, :class:`DenseTableSpec` are in
                              ``proto/tables.py``)
``replication.py``            ``assign_backups``, ``drop_server``, ``assignments_for``,
                              ``check_replication``: chain replication's placement (pure)
``resharding.py``             :class:`Resharding`, ``rendezvous_owners``: embedding slots placed
                              by rendezvous hashing, moved as servers are added or drained
``chunk_moves.py``            ``plan_moves``, ``hand_over``, ``moves_of``: a drained server's
                              dense chunks moved to the others (pure)
``recovery.py``               ``parse_table_report``, ``merge_chunks``: servers' reports (pure)
``policy_control.py``         :class:`PolicyControl`: the policy in force and its changes
                              (the policies themselves are ``proto/policy.py``)
``barriers.py``               :class:`Barriers`: named barriers of workers
``heartbeats.py``             :class:`Heartbeats`: the ``heartbeat`` op's reply from every part
``checkpointing.py``          :class:`CheckpointRounds`, :class:`Round`: rounds to a manifest
``checkpoint_coordinator.py`` :class:`CheckpointCoordinator`: when a round may start;
                              ``restore_job``, :class:`RestoredJob`: a job from a checkpoint
``lost.py``                   :class:`LostShards`: lost unreplicated ranks (bookkeeping)
``server_recovery.py``        :class:`ServerRecovery`: what to do when a server is lost or back
``rejoin.py``                 :class:`Rejoin`: registration with fencing; members gone
``waiters.py``                :class:`Waiters`: requests answered later, bounded per peer
``lifecycle.py``              :class:`JobLifecycle`: the end of a job (``hogshard stop``,
                              ``--exit-when-done``): workers, a final checkpoint, servers
``job_phase.py``              :class:`PhaseWatch`: the job's phase (starting, running,
                              degraded, failed, stopping, done) for ``status`` and the log
``metrics.py``                :class:`SchedulerCollector`: Prometheus metrics
============================  ================================================================
"""
