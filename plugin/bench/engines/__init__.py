"""Engine back ends for the trace benchmark: replays of request traces through real engine code."""
