"""The gateway service: the Tinker REST API and PlexRL's own API over phase requests.

It validates calls, turns them into PhaseRequests on Kafka and serves their results from
Redis; it never touches a model.
"""
