"""The engine, device side: the model runner (`model_runner.py`: every device tensor of the talker and the code
predictor, one CUDA graph per frame), the flat transformer stack it decodes with, the codec runner and the
incremental codec decoder, CUDA graph capture, the voice prefix cache and the asynchronous readback of frames."""
