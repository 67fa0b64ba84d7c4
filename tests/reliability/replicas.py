"""Which processes serve a deployment, read from Ray's own actor table.

Not by calling the replicas: sampling `describe` through a handle sees only the replicas its router picks (seen: right
after a repair, twelve calls all went to the new replica, so the survivor looked replaced), and a busy or starting
replica answers late. The table in Ray's control store lists every live replica actor with its pid. (Ray's public
state API reads it through the dashboard, which the tests' instances do not start, so this reads it directly.)
"""

from ray._private import state


def replica_pids(app_name: str, deployment: str) -> set[int]:
    """The pids of the deployment's live replica actors (starting ones included: their actor is up)."""
    class_name = f"ServeReplica:{app_name}:{deployment}"  # ray.serve._private.common.DeploymentID
    alive = state.actors(actor_state_name="ALIVE").values()
    return {actor["Pid"] for actor in alive if actor["ActorClassName"] == class_name}
