"""The control plane across replicas: controller, virtual replicas, routing, simulator."""
