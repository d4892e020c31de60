"""A request's way in: its rules and the builder (`builder.py`), the talker prompt (`prompt.py`), the text
tokenizer and segmenter, voices (`voice.py`), reference audio (`audio.py`) and fetching it from URLs
(`fetch.py`)."""
