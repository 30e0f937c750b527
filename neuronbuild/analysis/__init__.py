"""Analysis phase: TargetGraph -> ActionGraph (networkx DAG of trace and compile actions with fingerprints)."""
