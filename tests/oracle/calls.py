"""How a recorded call's reference-audio arguments become real ones, shared by the oracle script (official
package, its own environment) and the tests that replay the same calls through q3tts."""

import soundfile as sf


def audio_arg(value):
    """{"wav": path} is passed as the path; {"array": path} as an (array, sample rate) tuple; lists item-wise."""
    if isinstance(value, dict) and "wav" in value:
        return value["wav"]
    if isinstance(value, dict) and "array" in value:
        wav, sr = sf.read(value["array"], dtype="float32")
        return (wav, sr)
    return [audio_arg(v) for v in value] if isinstance(value, list) else value
