"""Elastic membership: a local job whose workers may leave without a restart (``elastic.*``).

The launcher side is testbed.launch.supervisor (it forks the ranks, serves their store and
announces each new membership); the rank side is testbed.elastic.membership (commits, the new
process group, the rollback); testbed.elastic.config holds the schema and its checks.
"""
