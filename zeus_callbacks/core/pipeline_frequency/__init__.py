"""The pipeline-frequency optimizer (Perseus): recording, clock sweep, DAG, frontier, control."""
