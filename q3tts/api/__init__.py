"""The front door in Python: `TTS` (`tts.py`), the official `Qwen3TTSModel` drop-in (`official.py`), streamed
audio (`streaming.py`) and long texts spoken as pieces (`pieces.py`)."""
