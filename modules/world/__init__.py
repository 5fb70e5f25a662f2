"""The synthetic world: moving coloured shapes, their captions, user requests and a GenEval that reads facts from pixels."""
