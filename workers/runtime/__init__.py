"""What every rank runs beside the train function: the worker actor's class, the TrainContext,
heartbeats, logs, credentials, telemetry, debug answers.
"""
