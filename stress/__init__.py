"""Drivers that stress a running cluster: the chaos soak (workers killed, transfers failed, every
answer checked against the engine alone), overload past saturation, hostile clients and the long
soak. Clients of the cluster, never imported by the serving path; `python -m stress.<name>`.
"""
