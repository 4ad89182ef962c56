"""The resharding benchmark behind `jaxreshard bench reshard`: its cases (`_cases.py`), the
simulated run of every strategy (`_simulated.py`) and the executed run on the local or the Ray
runtime (`_executed.py`)."""
