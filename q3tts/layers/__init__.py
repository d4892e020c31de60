"""Building blocks shared by the talker, the code predictor and the codec."""
