module compactd.dev/client

go 1.19

// The versions Debian bookworm packages, which the offline build (./modbuild, -mod=vendor) and
// GOPATH build (./gotest) compile against. With network access: `go mod tidy` (writes go.sum,
// raises genproto to the release grpc v1.33.3 requires), then `go build ./...`.
require (
	github.com/golang/protobuf v1.5.2
	google.golang.org/genproto v0.0.0-20200413115906-b5235f65be36
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)

require (
	golang.org/x/net v0.7.0 // indirect
	golang.org/x/sys v0.3.0 // indirect
	golang.org/x/text v0.7.0 // indirect
)
