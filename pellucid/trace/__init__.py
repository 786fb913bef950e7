"""Traces shown to people: the terminal walk-through, one HTML page and PNG plots
(`pellucid explain`). The records themselves and the recorder that fills them from engine hooks
live in engine/ (trace_records.py, trace_recorder.py), below this package, as the layers require.
"""
