"""The batch service: the OpenAI Files and Batches APIs, durable jobs run as a bulk class."""
