"""The pure-functional scheduler: state and plan pytrees, policies, block accounting.

Nothing here imports the backend or the model: a policy never knows if its plan is run or priced.
"""
