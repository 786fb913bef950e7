"""Traces: how one request was generated, as plain records (records.py), filled from engine hooks
(recorder.py) and shown in the terminal, as one HTML page or as PNG plots (`pellucid explain`).

Renderers are imported from their own modules so that the engine, which imports the recorder,
never pulls in rich or matplotlib.
"""
