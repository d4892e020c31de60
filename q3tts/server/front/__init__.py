"""The multi-process front of `q3tts serve --devices` (`app.py`): one engine process per device behind one
endpoint, its HTTP client to the engines (`upstream.py`) and the speech link between the front and an engine
process (`link.py`)."""
